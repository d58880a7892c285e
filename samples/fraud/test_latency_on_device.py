"""On-device latency test of the fraud sample's bundles (run on the device after `python -m samples.fraud.run`):

    pytest samples/fraud/test_latency_on_device.py --junitxml=fraud-latency.xml

Each bundle variant × batch size is measured against the bundle's latency budget; a bundle that is missing or built
for another device is skipped with the reason (see dsedge.pytest_plugin).
"""
import pytest


@pytest.mark.dsedge_bundle("out/fraud/bundles/student-cpu/student-run-cpu.dse",
                           "out/fraud/bundles/student-jetson/student-run-jetson-orin.dse")
def test_fraud_bundle_meets_its_budget(dsedge_latency):
    dsedge_latency.check()
