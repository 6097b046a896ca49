"""ReportHostState: apply host agents' inventory and heartbeat reports (SQS batch, partial failures)."""

import datetime as dt
import json

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

from ferry import hosts
from ferry.handlers import lambda_entry
from ferry.observability import logger, metrics

processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    attributes = record.raw_event.get("attributes", {})
    sent = attributes.get("SentTimestamp")  # when SQS took it (milliseconds)
    queued_at = dt.datetime.fromtimestamp(int(sent) / 1000, dt.UTC).replace(tzinfo=None) if sent else None
    hosts.apply_report(json.loads(record.body), queued_at, attributes.get("SenderId"))  # who sent it


@lambda_entry
@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics
def handler(event, context):
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
