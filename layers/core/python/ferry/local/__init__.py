"""Ferry's local stack: ``template.yaml`` running on one machine.

moto plays SQS, S3, DynamoDB, EventBridge, Lambda and Step Functions (its executor runs the
ASL files unchanged); Lambda invocations run the functions' real handlers in this process;
an HTTP server plays API Gateway with the template's authorizer; pollers play the SQS event
source mappings and schedules; one host agent per simulated hypervisor runs on libvirt's
``test`` driver. Everything is read from the template (:mod:`ferry.local.template`).
"""
