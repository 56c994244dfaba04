"""Engine adapters: kvhandoff behind an inference engine's own extension points."""
