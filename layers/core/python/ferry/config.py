"""Ferry's settings, read from the environment.

Lambda functions get them from the template's ``Globals.Function.Environment``; the local
stack sets the same variables from the same template. Every option has a default that
works on one machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ferry import errors


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise errors.SettingInvalid(f"{name}={raw!r} is not a whole number; unset it for the default ({default}), "
                                    f"or give a whole number") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise errors.SettingInvalid(f"{name}={raw!r} is not a finite number; unset it for the default ({default:g}), "
                                    f"or give a number")
    return value


# The variables that set default quota limits (instances, cores, RAM in MB).
QUOTA_VARIABLES = ("FERRY_QUOTA_INSTANCES", "FERRY_QUOTA_CORES", "FERRY_QUOTA_RAM")

# The variables naming the stack's host queues and image bucket. Their defaults serve one machine
# only (tests, the embedded stack): the template sets them for every function, and the entry
# points an operator runs outside the stack (the host agent, ``ferry audit``) refuse to start
# without them rather than reach a queue nothing sends to or another stack's bucket.
HOST_QUEUE_PREFIX_VARIABLE = "FERRY_HOST_QUEUE_PREFIX"
IMAGE_BUCKET_VARIABLE = "FERRY_IMAGE_BUCKET"


def is_set(variable: str) -> bool:
    """Whether the environment gives ``variable`` a value (not empty)."""
    return bool(os.environ.get(variable))


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    api_database_url: str
    image_bucket: str
    host_queue_prefix: str
    host_reports_queue_url: str
    notification_bus: str
    boot_state_machine_arn: str
    delete_state_machine_arn: str
    power_state_machine_arn: str
    resize_state_machine_arn: str
    confirm_resize_state_machine_arn: str
    revert_resize_state_machine_arn: str
    resize_confirm_window: int
    aws_endpoint_url: str | None
    scheduler_max_attempts: int
    # How many allocation candidates placement hands the scheduler per batch (Nova's default: 1000).
    max_placement_results: int
    allow_resize_to_same_host: bool
    service_down_time: int
    cpu_allocation_ratio: float
    ram_allocation_ratio: float
    disk_allocation_ratio: float
    ram_weight_multiplier: float
    cpu_weight_multiplier: float
    cross_cell_move_weight_multiplier: float
    soft_affinity_weight_multiplier: float
    soft_anti_affinity_weight_multiplier: float
    placement_max_retries: int
    policy_file: str | None
    # Default per-project quota limits as configured (raw; ferry.quotas validates them), by variable.
    quota_defaults: dict[str, str]
    volume_attachment_state_machine_arn: str
    drain_state_machine_arn: str
    # The secret the drain webhook checks requests with ("" turns the webhook off).
    webhook_secret: str
    # The secret drain callbacks are signed with ("" refuses drains that name a callback_url).
    callback_secret: str
    # Whether drain callbacks may go to private, shared and loopback addresses (not only global ones).
    callback_allow_private: bool
    # The DynamoDB table of the webhook's deliveries and one-time signatures.
    idempotency_table: str
    # What is done with a guest or instance directory a host still reports of a server whose
    # delete finished: "reap" (destroy it there) or "log" (only say so; anything else is "log").
    running_deleted_action: str = "reap"

    @property
    def default_cell_dir(self) -> Path:
        return self.state_dir


# What AWS Lambda's own runtime sets (``AWS_Lambda_python3.11``); the local stack's does not.
LAMBDA_EXECUTION_ENV_PREFIX = "AWS_Lambda_"


def load() -> Settings:
    """The settings from the environment.

    Raises:
        SettingInvalid: a number setting's variable holds no number (the message names it).
        DatabaseNotConfigured: on AWS Lambda without ``FERRY_API_DATABASE_URL`` (the stack's
            ``ApiDatabaseUrl``): its SQLite default would be each execution environment's own.
    """
    state_dir = Path(os.environ.get("FERRY_STATE_DIR", Path.cwd() / ".ferry")).resolve()
    if not is_set("FERRY_API_DATABASE_URL") and \
            os.environ.get("AWS_EXECUTION_ENV", "").startswith(LAMBDA_EXECUTION_ENV_PREFIX):
        raise errors.DatabaseNotConfigured(
            "FERRY_API_DATABASE_URL is empty: set the stack's ApiDatabaseUrl parameter to the API database's URL "
            "(on AWS Lambda the embedded SQLite database would be each execution environment's own).")
    return Settings(
        state_dir=state_dir,
        api_database_url=os.environ.get("FERRY_API_DATABASE_URL") or f"sqlite:///{state_dir / 'api.sqlite'}",
        image_bucket=os.environ.get(IMAGE_BUCKET_VARIABLE, "ferry-images"),
        host_queue_prefix=os.environ.get(HOST_QUEUE_PREFIX_VARIABLE, "ferry-host-"),
        host_reports_queue_url=os.environ.get("FERRY_HOST_REPORTS_QUEUE_URL", ""),
        notification_bus=os.environ.get("FERRY_NOTIFICATION_BUS", "ferry-notifications"),
        boot_state_machine_arn=os.environ.get("FERRY_BOOT_STATE_MACHINE_ARN", ""),
        delete_state_machine_arn=os.environ.get("FERRY_DELETE_STATE_MACHINE_ARN", ""),
        power_state_machine_arn=os.environ.get("FERRY_POWER_STATE_MACHINE_ARN", ""),
        resize_state_machine_arn=os.environ.get("FERRY_RESIZE_STATE_MACHINE_ARN", ""),
        confirm_resize_state_machine_arn=os.environ.get("FERRY_CONFIRM_RESIZE_STATE_MACHINE_ARN", ""),
        revert_resize_state_machine_arn=os.environ.get("FERRY_REVERT_RESIZE_STATE_MACHINE_ARN", ""),
        resize_confirm_window=_env_int("FERRY_RESIZE_CONFIRM_WINDOW", 0),
        aws_endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        scheduler_max_attempts=_env_int("FERRY_SCHEDULER_MAX_ATTEMPTS", 3),
        max_placement_results=_env_int("FERRY_MAX_PLACEMENT_RESULTS", 1000),
        allow_resize_to_same_host=_env_bool("FERRY_ALLOW_RESIZE_TO_SAME_HOST", False),
        service_down_time=_env_int("FERRY_SERVICE_DOWN_TIME", 60),
        cpu_allocation_ratio=_env_float("FERRY_CPU_ALLOCATION_RATIO", 4.0),
        ram_allocation_ratio=_env_float("FERRY_RAM_ALLOCATION_RATIO", 1.0),
        disk_allocation_ratio=_env_float("FERRY_DISK_ALLOCATION_RATIO", 1.0),
        ram_weight_multiplier=_env_float("FERRY_RAM_WEIGHT_MULTIPLIER", 1.0),
        cpu_weight_multiplier=_env_float("FERRY_CPU_WEIGHT_MULTIPLIER", 1.0),
        cross_cell_move_weight_multiplier=_env_float("FERRY_CROSS_CELL_MOVE_WEIGHT_MULTIPLIER", 1_000_000.0),
        soft_affinity_weight_multiplier=_env_float("FERRY_SOFT_AFFINITY_WEIGHT_MULTIPLIER", 1.0),
        soft_anti_affinity_weight_multiplier=_env_float("FERRY_SOFT_ANTI_AFFINITY_WEIGHT_MULTIPLIER", 1.0),
        placement_max_retries=_env_int("FERRY_PLACEMENT_MAX_RETRIES", 10),
        policy_file=os.environ.get("FERRY_POLICY_FILE") or None,
        quota_defaults={name: os.environ[name] for name in QUOTA_VARIABLES if os.environ.get(name)},
        volume_attachment_state_machine_arn=os.environ.get("FERRY_VOLUME_ATTACHMENT_STATE_MACHINE_ARN", ""),
        drain_state_machine_arn=os.environ.get("FERRY_DRAIN_STATE_MACHINE_ARN", ""),
        webhook_secret=os.environ.get("FERRY_WEBHOOK_SECRET", ""),
        callback_secret=os.environ.get("FERRY_CALLBACK_SECRET", ""),
        callback_allow_private=_env_bool("FERRY_CALLBACK_ALLOW_PRIVATE", False),
        idempotency_table=os.environ.get("FERRY_IDEMPOTENCY_TABLE", ""),
        running_deleted_action=os.environ.get("FERRY_RUNNING_DELETED_ACTION", "reap").strip().lower(),
    )


@lru_cache(maxsize=1)
def get() -> Settings:
    """The process's settings (cached; tests call ``reset()`` after changing the environment)."""
    return load()


def reset() -> None:
    get.cache_clear()
