"""`wedlm bench`: measurements users run against their own cluster (or any OpenAI-compatible
server). `serve`, `latency`, `links` and `agent` only talk to a server and need the client
install (plus the `openai` package for HTTP targets and matplotlib for the PNG: the [bench]
extra; `agent --api anthropic` the `anthropic` package);
`fetch` runs the worker's own layer fetcher and needs the [server] install."""
