"""Fault injection: armed points fail as asked, and nothing fails when it is off."""

from __future__ import annotations

import pytest

from ferry import errors, faults


@pytest.fixture
def armed_file(tmp_path, monkeypatch):
    path = tmp_path / "faults.json"
    monkeypatch.setenv(faults.ENV_VAR, str(path))
    return path


def test_off_unless_configured(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)

    faults.check("PrepResizeAtDest")
    with pytest.raises(errors.InvalidOperation):
        faults.arm("PrepResizeAtDest")


def test_a_once_fault_fires_once(armed_file):
    faults.arm("PrepResizeAtDest")

    with pytest.raises(errors.InjectedFault, match="PrepResizeAtDest"):
        faults.check("PrepResizeAtDest")
    faults.check("PrepResizeAtDest")


def test_an_always_fault_fires_until_disarmed_with_the_named_error(armed_file):
    faults.arm("*:finish_resize", faults.ALWAYS, "DiskCopyFailed")

    for _ in range(2):
        with pytest.raises(errors.DiskCopyFailed):
            faults.check(*faults.host_points("cell1-host2", "finish_resize"))
    faults.disarm_all()
    faults.check(*faults.host_points("cell1-host2", "finish_resize"))


def test_other_points_are_untouched(armed_file):
    faults.arm("cell1-host1:resize_instance")

    faults.check(*faults.host_points("cell1-host2", "resize_instance"))
    with pytest.raises(errors.InjectedFault):
        faults.check(*faults.host_points("cell1-host1", "resize_instance"))


def test_an_unknown_mode_is_refused(armed_file):
    with pytest.raises(errors.InvalidOperation):
        faults.arm("X", "sometimes")


def test_a_host_operation_is_armed_by_the_task_state_that_sent_it(armed_file):
    faults.arm("FinishResizeOnDestHost")
    operation_id = "exec-1/FinishResizeOnDestHost/cell1-host2"

    faults.check(*faults.host_points("cell1-host2", "finish_resize", "exec-1/PrepResizeOnDestHost/cell1-host2"))
    with pytest.raises(errors.InjectedFault, match="FinishResizeOnDestHost"):
        faults.check(*faults.host_points("cell1-host2", "finish_resize", operation_id))
