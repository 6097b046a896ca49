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


def test_a_timeout_fires_once_as_the_error_lambda_reports_for_a_function_timeout(armed_file):
    faults.arm("PrepResizeAtDest", faults.TIMEOUT)

    with pytest.raises(faults.InjectedTimeout) as raised:
        faults.check("PrepResizeAtDest")
    assert type(raised.value).__name__ == "Sandbox.Timedout"
    assert not isinstance(raised.value, errors.FerryError)
    faults.check("PrepResizeAtDest")


def test_a_timeout_holds_until_its_point_is_disarmed(armed_file):
    faults.arm("cell1-host2:prep_resize", faults.TIMEOUT)
    faults.arm("cell1-host1:power_off", faults.ALWAYS)

    with pytest.raises(faults.InjectedTimeout) as raised:
        faults.check_timeout(*faults.host_points("cell1-host2", "prep_resize"))
    timeout = raised.value
    assert timeout.point == "cell1-host2:prep_resize"
    assert faults.holding(timeout)
    faults.check(*faults.host_points("cell1-host2", "prep_resize"))  # the fired timeout lets others pass

    faults.disarm("cell1-host2:prep_resize")
    assert not faults.holding(timeout)
    with pytest.raises(errors.InjectedFault):
        faults.check(*faults.host_points("cell1-host1", "power_off"))


def test_check_timeout_leaves_other_faults_armed(armed_file):
    faults.arm("*:finish_resize", faults.ONCE, "DiskCopyFailed")

    faults.check_timeout(*faults.host_points("cell1-host2", "finish_resize"))
    with pytest.raises(errors.DiskCopyFailed):
        faults.check(*faults.host_points("cell1-host2", "finish_resize"))


def test_a_timeout_armed_with_hold_seconds_lets_go_after_them(armed_file, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(faults.time, "time", lambda: now[0])
    faults.arm("*:finish_resize", faults.TIMEOUT, hold_seconds=30)

    with pytest.raises(faults.InjectedTimeout) as raised:
        faults.check_timeout(*faults.host_points("cell1-host2", "finish_resize"))
    now[0] += 29
    assert faults.holding(raised.value)
    now[0] += 2
    assert not faults.holding(raised.value)


def test_a_timeout_armed_again_releases_the_held_operation_and_fires_anew(armed_file):
    faults.arm("FinishResizeOnDestHost", faults.TIMEOUT)
    with pytest.raises(faults.InjectedTimeout) as first:
        faults.check_timeout("FinishResizeOnDestHost")

    faults.arm("FinishResizeOnDestHost", faults.TIMEOUT)

    assert not faults.holding(first.value)
    with pytest.raises(faults.InjectedTimeout) as second:
        faults.check_timeout("FinishResizeOnDestHost")
    assert faults.holding(second.value)
    faults.disarm_all()
    assert not faults.holding(second.value)


def test_nothing_holds_when_fault_injection_is_off(armed_file, monkeypatch):
    faults.arm("X", faults.TIMEOUT)
    with pytest.raises(faults.InjectedTimeout) as raised:
        faults.check("X")
    monkeypatch.delenv(faults.ENV_VAR)

    assert not faults.holding(raised.value)
    faults.check_timeout("X")
