"""The tracing section: OpenTelemetry export, log level, and the metric trackers, each by its `type`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from services.contracts.config_base import Section
from services.contracts.untyped import JsonValue


class JsonlTrackerConfig(Section):
    """RUN_DIR/metrics.jsonl: every run has it, listed or not."""

    type: Literal["jsonl"] = "jsonl"


class TensorBoardTrackerConfig(Section):
    """RUN_DIR/tensorboard (needs the `tensorboard` package)."""

    type: Literal["tensorboard"] = "tensorboard"


class WandbTrackerConfig(Section):
    """Weights & Biases (the `wandb` extra); WANDB_MODE=offline works without a login."""

    type: Literal["wandb"] = "wandb"
    project: str | None = Field(default=None, description="the W&B project (default tandem)")


class PrometheusTrackerConfig(Section):
    """An HTTP endpoint on the coordinator serving the latest metrics for Prometheus to scrape."""

    type: Literal["prometheus"] = "prometheus"
    port: int = Field(default=0, ge=0, le=65535, description="0 = pick a free port (the coordinator logs it)")


TrackerConfig = Annotated[
    JsonlTrackerConfig | TensorBoardTrackerConfig | WandbTrackerConfig | PrometheusTrackerConfig,
    Field(discriminator="type"),
]
_MOVED_TRACING_KEYS = {
    "wandb_project": "trackers: [jsonl, {type: wandb, project: NAME}]",
    "prometheus_port": "trackers: [jsonl, {type: prometheus, port: PORT}]",
}


class TracingConfig(Section):
    exporter: Literal["none", "file", "console", "otlp"] = "none"
    file_path: str | None = Field(default=None, description="defaults to RUN_DIR/traces.jsonl")
    trackers: tuple[TrackerConfig, ...] = Field(
        default=(JsonlTrackerConfig(),),
        description="each a name (jsonl, tensorboard, wandb, prometheus) or a "
        "mapping with `type` and that tracker's own keys, e.g. {type: wandb, project: my-project}",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: JsonValue) -> JsonValue:
        for key, where in _MOVED_TRACING_KEYS.items():
            if isinstance(data, dict) and key in data:
                raise ValueError(f"{key} is now a key of its tracker: {where}")
        return data

    @field_validator("trackers", mode="before")
    @classmethod
    def _named_trackers(cls, value: JsonValue) -> JsonValue:
        """A tracker given by its name alone (`trackers: [jsonl, wandb]`) is that tracker with its defaults."""
        if isinstance(value, list | tuple):
            return [{"type": item} if isinstance(item, str) else item for item in value]
        return value

    def tracker_names(self) -> tuple[str, ...]:
        return tuple(t.type for t in self.trackers)
