"""Benchmarks: ``python -m bench.engine.serving`` (a running engine under concurrent load) and
``python -m bench.engine.hf_baseline`` (transformers ``generate`` on the same model and prompts).

Both use :data:`PROMPTS`, so their figures compare like with like.
"""

PROMPTS: list[str] = [
    "Explain in simple words why the sky is blue.",
    "Write a short poem about a lighthouse keeper who loves the sea.",
    "What are the three most important things to know about compound interest?",
    "List some good habits for writing clean and maintainable Python code.",
    "Describe the water cycle to a ten year old child.",
    "Give me a recipe for a quick vegetarian pasta dinner for two people.",
    "Summarize the plot of a story about a robot that learns to paint.",
    "Why do cats purr? Give a few possible explanations.",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting my colleagues to a team lunch on Friday.",
    "How does a bicycle stay upright while it is moving?",
    "Tell me about the history of the printing press and why it mattered.",
    "What should I pack for a three day hiking trip in the mountains in autumn?",
    "Explain what a hash table is and when you would use one.",
    "Suggest five names for a small bakery in a seaside town.",
    "How do vaccines train the immune system?",
]
"""Sixteen prompts of mixed length (about 10 to 20 tokens)."""


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` shows it ("AMD EPYC", "Intel(R) Xeon(R) ..."), for the JSON
    a benchmark prints: float results and timings both depend on it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
