"""ComputeApi: the Nova-compatible compute API behind API Gateway (REST API proxy events)."""

from aws_lambda_powertools.logging import correlation_paths

from ferry.api import get_resolver
from ferry.handlers import lambda_entry
from ferry.observability import logger, metrics

app = get_resolver()


@lambda_entry
@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_REST, clear_state=True)
@metrics.log_metrics
def handler(event, context):
    return app.resolve(event, context)
