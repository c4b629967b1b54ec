import vexact_verl


def test_placeholder_exposes_only_its_version():
    assert vexact_verl.__version__ == "0.1.0"
    assert vexact_verl.__all__ == ["__version__"]
