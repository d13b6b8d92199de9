"""Who may talk to the exporter, in one audit surface: the exporter-toolkit web config,
server TLS, basic auth, and the policy in force (headers, reload)."""
