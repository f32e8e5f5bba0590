"""The weights section, by weights.transport: the keys every transport has, and each transport's own."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from services.contracts.config_base import Section


class WeightsSettings(Section):
    """The keys of weights every transport has."""

    transport: Literal["gloo", "nccl", "cuda_ipc", "disk"] = "gloo"
    bucket_mb: float = Field(default=64.0, gt=0, description="weight_bucket_mb: size of flattened buckets")
    timeout_s: float = Field(default=120.0, gt=0, description="deadline of one transfer")
    check_weight_update_equal: bool = Field(
        default=False,
        description="every engine checks each synced bucket "
        "against the trainer's checksum; a bucket that differs is sent again "
        "and checked tensor by tensor, naming the tensors",
    )
    trainer_id: str | None = Field(
        default=None,
        description="id the actor trainer announces in its plans; rollout "
        "engines refuse plans (CUDA IPC handles included) of any other id. `tandem run` "
        "sets <run_name>/actor; unset = engines accept any trainer",
    )
    # every transport's, though disk meets at no store: a deployment wires it (docker compose, the chart, Slurm)
    # whatever transport the run picks
    master_addr: str = Field(
        default="127.0.0.1",
        description="the trainer's host as the engines reach it: the store gloo, nccl and cuda_ipc meet at",
    )


class ProcessGroupWeights(WeightsSettings):
    """gloo or nccl: a process group of the trainer's rank 0 and every engine rank, met at the trainer's store."""

    transport: Literal["gloo", "nccl"] = "gloo"


class CudaIpcWeights(WeightsSettings):
    """cuda_ipc: trainer and engines on one GPU host; the handles go in the plan, a small store carries the
    handshake."""

    transport: Literal["cuda_ipc"] = "cuda_ipc"


class DiskWeights(WeightsSettings):
    """disk: safetensors files on a directory the trainer and the engines share."""

    transport: Literal["disk"] = "disk"
    disk_dir: str | None = Field(default=None, description="defaults to RUN_DIR/weights")


# weights: by weights.transport (gloo when not given); a key of another transport is refused by name
WeightsConfig = Annotated[ProcessGroupWeights | CudaIpcWeights | DiskWeights, Field(discriminator="transport")]
_WEIGHTS: TypeAdapter[WeightsConfig] = TypeAdapter(WeightsConfig)


def weights_config(**keys: object) -> WeightsConfig:
    """The weights section of these keys, as a YAML file would give it (`transport` picks the variant)."""
    return _WEIGHTS.validate_python({"transport": "gloo", **keys})


def for_transport(weights: WeightsConfig, transport: str) -> WeightsConfig:
    """The run's weights section as another transport reads it (a PrepareWeightSync may name one): every key the two
    share carried over, that transport's own at their defaults."""
    if weights.transport == transport:
        return weights
    target = _WEIGHTS.validate_python({"transport": transport})
    shared = {k: v for k, v in weights.model_dump().items() if k in type(target).model_fields and k != "transport"}
    return target.model_copy(update=shared)
