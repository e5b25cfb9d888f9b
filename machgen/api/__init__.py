"""machgen's HTTP API over served models: OpenAI's images and videos APIs,
jobs with progress and live previews (Server-Sent Events), webhooks, durable
job records and results, API keys and limits, a playground page, metrics.

It talks gRPC to Triton (each request to the model's streaming twin
NAME_stream) and imports no torch: ``pip install machgen[api]``.
``machgen api --triton HOST:8001 --port 8080`` runs it: app.py assembles the routers of routes/ (one
per resource), which hand image and video jobs to one request pipeline (pipeline.py).
"""
