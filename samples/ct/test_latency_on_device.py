"""On-device latency test of the CT sample's bundles (run on the device after `python -m samples.ct build`):

    pytest samples/ct/test_latency_on_device.py --junitxml=ct-latency.xml

Each bundle variant × batch size is measured against the bundle's latency budget; a bundle that is missing or built
for another device is skipped with the reason (see dsedge.pytest_plugin).
"""
import pytest


@pytest.mark.dsedge_bundle("runs/bundles/student-cpu-fp32/ct-student-cpu.dse",
                           "runs/bundles/student-jetson-int8/ct-student-jetson-orin.dse")
def test_ct_bundle_meets_its_budget(dsedge_latency):
    dsedge_latency.check()
