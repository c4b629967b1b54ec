import vexact_verl

PUBLIC = ["ROLLOUT_NAME", "ServerSettings", "VexactServer", "__version__", "is_registered", "packed_log_probs"]
PUBLIC += ["register", "tim_step_metrics"]


def test_public_api():
    assert vexact_verl.__version__ == "0.3.1"
    assert sorted(vexact_verl.__all__) == sorted(PUBLIC)
    assert all(hasattr(vexact_verl, name) for name in PUBLIC)
    assert vexact_verl.ROLLOUT_NAME == "vexact"
