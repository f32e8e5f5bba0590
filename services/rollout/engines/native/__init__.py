"""The native engine: HF transformers models in this process, static or continuous batching (`engine.NativeEngine`)."""
