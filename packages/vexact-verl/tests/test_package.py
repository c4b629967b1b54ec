import vexact_verl


def test_public_api():
    assert vexact_verl.__version__ == "0.1.1"
    assert set(vexact_verl.__all__) == {
        "ROLLOUT_NAME", "ServerSettings", "VexactServer", "__version__", "is_registered", "register"
    }  # fmt: skip
    assert vexact_verl.ROLLOUT_NAME == "vexact"
