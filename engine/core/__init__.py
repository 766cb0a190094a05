"""The engine core: scheduling, the model runner and the step loop, in the engine's own types."""
