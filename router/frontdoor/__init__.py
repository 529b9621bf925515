"""The front doors: gRPC (``grpc_server``) and OpenAI-compatible HTTP (``http_app`` with
``openai/``), the auth gate (``security``, ``http_guard``), the typed-error mapping (``errors``),
Prometheus metrics (``metrics``), and both doors' start and drain on one loop (``lifecycle``).
Imports only ``router.contract`` of the router."""
