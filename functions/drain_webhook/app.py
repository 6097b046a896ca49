"""DrainWebhook: starts a drain from a signed request (POST /webhooks/drain, no token; see ferry.webhook)."""

from aws_lambda_powertools.logging import correlation_paths

from ferry import webhook
from ferry.handlers import lambda_entry
from ferry.observability import logger, metrics


@lambda_entry
@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_REST, clear_state=True)
@metrics.log_metrics
def handler(event, context):
    return webhook.handle(event, context)
