"""TokenAuthorizer: validates X-Auth-Token and hands the caller's identity to the compute API."""

from ferry import auth, errors
from ferry.handlers import lambda_entry
from ferry.observability import logger, metrics


@lambda_entry
@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics
def handler(event, context):
    try:
        return auth.authorize(event)
    except errors.Unauthorized:
        # API Gateway answers 401 only for a failure whose message is exactly "Unauthorized".
        raise Exception("Unauthorized") from None
