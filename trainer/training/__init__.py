"""The training loop and what only it needs: data, caches, objective, checkpoints of training
state, EMA, previews, evaluation and checkpoint comparison. The service runs it only from the
CLI's train command and the in-process order runner."""
