"""The exporter's HTTP API: routes (one router per resource), their dependencies, the
response models and the one error shape."""
