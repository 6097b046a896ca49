"""AutoConfirm: confirm resizes left unconfirmed longer than the resize confirm window (scheduled)."""

from ferry.handlers import lambda_entry
from ferry.observability import logger, metrics
from ferry.workflows import auto_confirm


@lambda_entry
@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics
def handler(event, context):
    return auto_confirm.run()
