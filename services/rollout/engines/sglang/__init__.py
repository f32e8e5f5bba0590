"""SGLang behind the Engine interface, and both halves of a weight sync toward SGLang servers.

`engine.SGLangEngine` (the adapter) speaks to one or more SGLang servers over HTTP (`http`, `protocol`, `servers`,
`launch`). Weight sync: the trainer's senders (`weight_send_group` for gloo/nccl, `weight_send_tensor` for cuda_ipc),
which services/weights/transport_registry.py imports when a run syncs toward SGLang, and the adapter's receiving
halves (`weight_sync_group`, `weight_sync_tensor`).
"""
