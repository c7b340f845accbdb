"""jmp's vendored tests run from tests/test_jmp_upstream.py, not collected on their own."""

collect_ignore = ["loss_scale_test.py", "policy_test.py"]
