"""What the libvirt driver writes for QEMU, accepted and run by libvirt's test driver too."""

from __future__ import annotations

import uuid
import xml.etree.ElementTree as ET

import libvirt
import pytest
from flavors import TINY as FLAVOR

from hostagent.driver import RUNNING, SHUTDOWN, DiskSpec, GuestSpec, LibvirtDriver, PortSpec, write_test_node_xml

PORT_ID = "5b0e9c3a-1f2d-4e6a-8b7c-9d0e1f2a3b4c"


def _driver(tmp_path, **options) -> LibvirtDriver:
    return LibvirtDriver(write_test_node_xml(tmp_path / "node.xml", vcpus=4, memory_mb=8192), **options)


def _spec() -> GuestSpec:
    return GuestSpec(
        instance_uuid=str(uuid.uuid4()),
        display_name="db 1",
        flavor=FLAVOR,
        disks=(DiskSpec(kind="root", path="/var/lib/ferry/instances/disk", device="vda", boot=True),),
        ports=(PortSpec(port_id=PORT_ID, mac_address="fa:16:3e:00:00:0a"),),
    )


def _live(drv: LibvirtDriver, instance_uuid: str) -> ET.Element:
    return ET.fromstring(drv.connection.lookupByUUIDString(instance_uuid).XMLDesc(0))


@pytest.mark.parametrize("mode", ["host-model", "host-passthrough"])
def test_the_test_driver_runs_a_guest_with_a_cpu_mode(tmp_path, mode):
    drv = _driver(tmp_path, cpu_mode=mode)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)

        assert _live(drv, spec.instance_uuid).find("cpu").get("mode") == mode
        assert drv.guest_power_state(spec.instance_uuid) == RUNNING
    finally:
        drv.close()


@pytest.mark.parametrize("vif_type", ["ovs", "bridge"])
def test_the_test_driver_runs_a_guest_with_ports_on_a_bridge(tmp_path, vif_type):
    drv = _driver(tmp_path, port_bridge="br-int", port_vif_type=vif_type)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)

        interface = _live(drv, spec.instance_uuid).find("devices/interface")
        assert interface.get("type") == "bridge"
        assert interface.find("target").get("dev") == "tap5b0e9c3a-1f"
        assert (interface.find("virtualport") is not None) == (vif_type == "ovs")
        drv.detach_interface(spec.instance_uuid, PORT_ID)
        assert _live(drv, spec.instance_uuid).find("devices/interface") is not None, "changes at the next boot"
        assert drv.guest_spec(spec.instance_uuid).ports == ()
    finally:
        drv.close()


def test_power_on_resumes_a_guest_paused_on_the_test_driver(tmp_path):
    drv = _driver(tmp_path)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)
        dom = drv.connection.lookupByUUIDString(spec.instance_uuid)
        dom.suspend()
        assert dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED

        drv.power_on(spec.instance_uuid)
        assert drv.guest_power_state(spec.instance_uuid) == RUNNING

        dom.suspend()
        drv.power_off(spec.instance_uuid, timeout=5)
        assert drv.guest_power_state(spec.instance_uuid) == SHUTDOWN
    finally:
        drv.close()
