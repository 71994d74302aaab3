"""Notebook 07's playbook panel is a thin view: its state is the library's answer, errors show in the panel."""

from kvlab.capacity.source_deployments import comparison_rows, reproduce
from kvlab.viz.playbook import PlaybookPanel, figure_levers, figure_source_vs_exact, panel_state


def test_panel_state_is_the_library_playbook():
    state = panel_state("qwen3-8b", "L40S", max_model_len=8192, non_kv_gib=0)
    result = state["result"]
    assert state["log"] == list(result.startup_log) and state["decision"] == result.decision
    assert state["levers"] == [lever.name for lever in result.levers if lever.applicable]


def test_presets_load_the_source_deployments_exactly():
    panel = PlaybookPanel(preset="a")
    for key in "abc":
        panel.apply_preset(key)
        assert panel.state["result"].plan == reproduce(key)["exact"].plan
    assert "kvlab-decision" in panel.summary.value and "kvlab-levers" in panel.summary.value


def test_controls_drive_the_state_and_redraw_in_place():
    panel = PlaybookPanel(preset="a")
    widget, before = panel.figure, panel.state["result"].max_concurrency
    panel.kv_dtype.value = "fp8"
    assert panel.state["result"].max_concurrency > 1.9 * before and panel.figure is widget
    assert "FP8 KV cache" not in panel.state["levers"]
    panel.shared_prefix.value = 0.5
    assert panel.state["result"].workload.shared_prefix_tokens == 500
    panel.rank_by.value = "typical"
    typical = [lever.gain_typical for lever in panel.state["result"].levers if lever.applicable]
    assert typical == sorted(typical, reverse=True)


def test_a_refused_setting_shows_its_error_and_keeps_the_last_state():
    panel = PlaybookPanel(preset="a")
    before = panel.state
    panel.tp.value = 8                 # Qwen3-8B has 8 KV heads: fine; then 3 would not divide them
    panel.tp.value = 1
    panel.mean_output_tokens.value = 0
    assert panel.errors.outputs == ()
    panel.model.value = "deepseek-v3"  # weights alone exceed one L40S: a plan with warnings, not an error
    assert panel.state["warnings"] and panel.state is not before
    assert "kvlab-budget-warning" in panel.summary.value


def test_the_error_box_appears_when_the_library_refuses(monkeypatch):
    import kvlab.viz.playbook as viz
    from kvlab.errors import KvlabValueError

    panel = PlaybookPanel(preset="a")
    before = panel.state

    def refuse(*args, **kwargs):
        raise KvlabValueError("max_model_len must be a positive integer, got 0")

    monkeypatch.setattr(viz, "plan_deployment", refuse)
    panel.max_model_len.value = 4096
    assert panel.state is before and "kvlab-callback-error" in str(panel.errors.outputs)
    monkeypatch.undo()
    panel.max_model_len.value = 8192
    assert panel.errors.outputs == ()


def test_figures_show_one_row_per_applicable_lever_and_one_group_per_deployment():
    result = reproduce("a")["exact"]
    fig = figure_levers(result)
    assert len(fig.data) == 2 and len(fig.data[0].y) == 1 + sum(lever.applicable for lever in result.levers)
    assert fig.data[0].x[-1] == result.max_concurrency                       # "as configured" is drawn at the top
    assert len(figure_source_vs_exact(comparison_rows()).data[0].x) == 3


def test_the_shared_prefix_figure_rises_from_the_unshared_count():
    from kvlab.viz.playbook import figure_shared_prefix

    source = reproduce("a")["source"]
    fig = figure_shared_prefix(source.deployment, source.workload)
    counts = list(fig.data[0].y)
    assert counts[0] == reproduce("a")["exact"].concurrency_typical and counts == sorted(counts)
