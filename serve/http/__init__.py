"""The REST port: TF Serving REST, KServe V2 and the web page, on this project's own hardened HTTP/1.1 protocol."""
