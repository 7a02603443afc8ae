"""The REST port: an ASGI app (TF Serving REST, KServe V2, the web page) under a hardened uvicorn protocol."""
