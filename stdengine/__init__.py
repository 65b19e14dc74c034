"""stdengine: one standard face (CLI, config, logs, benchmarker, conformance) for every LLM engine."""

__version__ = "0.1.0"
SPEC_VERSION = "0.1"
DEFAULT_MODEL = "smollm2-135m-instruct"
