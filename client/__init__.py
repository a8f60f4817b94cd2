"""sits_trace.client: what an inference server calls to follow the agent's decisions."""
