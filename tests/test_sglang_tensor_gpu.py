"""On a GPU: the trainer's SGLang payloads hold CUDA IPC handles named by device UUID (what SGLang's patched consumer
maps to its own index), and the contract server accepts them without unpickling. Skipped without CUDA."""

from __future__ import annotations

import base64

import pytest
import torch
from helpers.sglang_contract_weights import inspect_pickle, payload_problem

from services.rollout.engines.sglang.weight_send_tensor import bucket_payload, serialize_for_sglang
from services.weights.layout import TensorSpec, plan_layout

pytestmark = pytest.mark.gpu


def test_sglang_payloads_of_cuda_buckets_name_the_device_by_uuid():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    specs = [TensorSpec("a.weight", "bfloat16", (8, 4)), TensorSpec("b.weight", "bfloat16", (4,))]
    (bucket,) = plan_layout(specs, bucket_bytes=1 << 20).buckets
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8, device="cuda")
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    for load_format in ("tensor", "flattened_bucket"):
        payload = serialize_for_sglang(bucket_payload(bucket, buffer, load_format=load_format))
        assert payload_problem(payload) is None
        names, strings = inspect_pickle(base64.b64decode(payload))
        assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in names
        assert uuid in strings and {"a.weight", "b.weight"} <= set(strings)
