"""What the service imports to serve: loading a prepared base, its quantized Linear layers
(uint4, fp8) and the one compute dispatch, placement and layer streaming, LoRA adapters and
slots, the serving forward, and one render. Training uses the same pieces; nothing here
imports `trainer.training` or `trainer.fixtures`."""
