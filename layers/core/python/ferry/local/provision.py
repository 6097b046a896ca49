"""Creating the resolved template's resources in the local AWS (idempotent).

Queues (dead-letter queues first, then the queues that redrive to them), buckets, DynamoDB
tables, event buses, Lambda functions (a placeholder zip: invocations run the real handlers,
see :mod:`ferry.local.runtime`) and state machines with their substituted definitions.
SQS event source mappings are not created in moto — moto would invoke the function itself on
every SendMessage; :mod:`ferry.local.pollers` plays them instead.
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

from ferry.local.template import LocalTemplate, Queue

log = logging.getLogger("ferry-local")

LOCAL_ROLE_NAME = "ferry-local-execution"
_TRUST_POLICY = {
    "Version": "2012-10-17",
    "Statement": [
        {
            "Effect": "Allow",
            "Principal": {"Service": ["lambda.amazonaws.com", "states.amazonaws.com"]},
            "Action": "sts:AssumeRole",
        }
    ],
}


def _placeholder_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("README.txt", "The local stack runs this function's handler from its code folder.\n")
    return buffer.getvalue()


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _ordered_queues(model: LocalTemplate) -> list[Queue]:
    """Queues with every dead-letter target before the queues that redrive to it."""
    dead_letter_arns = {q.dead_letter_arn for q in model.queues.values() if q.dead_letter_arn}
    return sorted(model.queues.values(), key=lambda q: (q.arn not in dead_letter_arns, q.logical_id))


def provision(model: LocalTemplate, client: Callable[[str], Any]) -> None:
    """Create (or bring up to date) every resource of ``model``.

    Args:
        model: the resolved template.
        client: ``client(service)`` returns a boto3 client for the local AWS.

    Raises:
        botocore.exceptions.ClientError: moto refused a resource (an invalid definition, say).
    """
    iam = client("iam")
    try:
        role_arn = iam.create_role(RoleName=LOCAL_ROLE_NAME, AssumeRolePolicyDocument=json.dumps(_TRUST_POLICY))[
            "Role"
        ]["Arn"]
    except ClientError as exc:
        if _error_code(exc) != "EntityAlreadyExists":
            raise
        role_arn = iam.get_role(RoleName=LOCAL_ROLE_NAME)["Role"]["Arn"]

    sqs = client("sqs")
    for queue in _ordered_queues(model):
        try:
            sqs.create_queue(QueueName=queue.name, Attributes=queue.attributes)
        except ClientError as exc:
            if _error_code(exc) not in ("QueueAlreadyExists", "QueueNameExists"):
                raise
            url = sqs.get_queue_url(QueueName=queue.name)["QueueUrl"]
            sqs.set_queue_attributes(
                QueueUrl=url, Attributes={k: v for k, v in queue.attributes.items() if k != "FifoQueue"}
            )

    s3 = client("s3")
    for bucket in model.buckets.values():
        try:
            if model.region == "us-east-1":
                s3.create_bucket(Bucket=bucket.name)
            else:
                s3.create_bucket(Bucket=bucket.name, CreateBucketConfiguration={"LocationConstraint": model.region})
        except ClientError as exc:
            if _error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        if bucket.versioning:
            s3.put_bucket_versioning(Bucket=bucket.name, VersioningConfiguration={"Status": bucket.versioning})

    dynamodb = client("dynamodb")
    for table in model.tables.values():
        spec: dict[str, Any] = {
            "TableName": table.name,
            "KeySchema": table.key_schema,
            "AttributeDefinitions": table.attribute_definitions,
            "BillingMode": table.billing_mode,
        }
        if table.billing_mode == "PROVISIONED":
            spec["ProvisionedThroughput"] = {"ReadCapacityUnits": 5, "WriteCapacityUnits": 5}
        if table.global_secondary_indexes:
            spec["GlobalSecondaryIndexes"] = table.global_secondary_indexes
        try:
            dynamodb.create_table(**spec)
        except ClientError as exc:
            if _error_code(exc) != "ResourceInUseException":
                raise
        if table.ttl_attribute:
            current = dynamodb.describe_time_to_live(TableName=table.name)["TimeToLiveDescription"]
            if current.get("TimeToLiveStatus") != "ENABLED":
                dynamodb.update_time_to_live(
                    TableName=table.name,
                    TimeToLiveSpecification={"AttributeName": table.ttl_attribute, "Enabled": True},
                )

    events = client("events")
    for bus in model.event_buses.values():
        try:
            events.create_event_bus(Name=bus.name)
        except ClientError as exc:
            if _error_code(exc) != "ResourceAlreadyExistsException":
                raise

    lambda_ = client("lambda")
    code = _placeholder_zip()
    for function in model.functions.values():
        settings = {
            "Role": role_arn,
            "Handler": function.handler,
            "Runtime": function.runtime,
            "Timeout": function.timeout,
            "MemorySize": function.memory_size,
            "Environment": {"Variables": function.environment},
        }
        try:
            lambda_.create_function(FunctionName=function.name, Code={"ZipFile": code}, **settings)
        except ClientError as exc:
            if _error_code(exc) != "ResourceConflictException":
                raise
            lambda_.update_function_configuration(FunctionName=function.name, **settings)

    sfn = client("stepfunctions")
    existing = {m["name"]: m["stateMachineArn"] for m in sfn.list_state_machines()["stateMachines"]}
    for machine in model.state_machines.values():
        definition = machine.definition()
        if machine.name in existing:
            sfn.update_state_machine(stateMachineArn=existing[machine.name], definition=definition, roleArn=role_arn)
        else:
            sfn.create_state_machine(name=machine.name, definition=definition, roleArn=role_arn)
    log.info(
        "provisioned %d queues, %d buckets, %d tables, %d event buses, %d functions, %d state machines",
        len(model.queues),
        len(model.buckets),
        len(model.tables),
        len(model.event_buses),
        len(model.functions),
        len(model.state_machines),
    )
