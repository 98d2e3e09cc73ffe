"""The server side: launching tritonserver for an engine directory, filling ``model_repo/``, wire
helpers the Triton models share, the cancellation relay, and the OpenAI-compatible frontend.
Imports ``runtime`` and ``builder``; nothing below imports it (``model_repo`` models do, at run time)."""
