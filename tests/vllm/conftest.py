"""tests/vllm runs only where vLLM 0.33.0 is importable (``make test-vllm``); elsewhere every module skips."""

import sys


def pytest_terminal_summary(terminalreporter):
    twin = sys.modules.get("twin")
    if twin is not None:
        terminalreporter.write_line(f"kvlab against vLLM: {twin.COMPARED[0]:,} operations compared, step by step")
    sched_twin = sys.modules.get("sched_twin")
    if sched_twin is not None:
        steps = sched_twin.STEPS_COMPARED[0]
        terminalreporter.write_line(f"kvlab's Scheduler against vLLM's: {steps:,} steps compared")
