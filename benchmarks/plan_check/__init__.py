"""``lowbit-plan``'s predictions against recorded multi-node runs
(``python -m benchmarks.plan_check``)."""
