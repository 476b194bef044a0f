"""A script written against llama-cpp-python's high-level API; with `from innerq import Llama`
it must run unchanged. Prints one JSON object describing what it got.

    python tests/llama_cpp_compat_script.py MODEL.gguf            # innerq
    python tests/llama_cpp_compat_script.py MODEL.gguf llama_cpp  # llama-cpp-python, where installed
"""
import json
import sys

if len(sys.argv) > 2 and sys.argv[2] == "llama_cpp":
    from llama_cpp import Llama
else:
    from innerq import Llama

model_path = sys.argv[1]

llm = Llama(model_path=model_path, n_ctx=512, n_gpu_layers=-1, verbose=False)  # every layer on a GPU if there is one

# text completion, stop strings, echo
output = llm("Q: Name the planets in the solar system? A: ", max_tokens=32, temperature=0, stop=["Q:", "\n"])
text = output["choices"][0]["text"]
assert "Q:" not in text and "\n" not in text
assert output["choices"][0]["finish_reason"] in ("stop", "length")
echoed = llm("The sky is", max_tokens=8, temperature=0, echo=True)["choices"][0]["text"]
assert echoed.startswith("The sky is")

# streaming completion
pieces = [chunk["choices"][0]["text"] for chunk in
          llm.create_completion("Once upon a time", max_tokens=16, temperature=0, stream=True)]
whole = llm.create_completion("Once upon a time", max_tokens=16, temperature=0)["choices"][0]["text"]
assert "".join(pieces) == whole

# chat completion, plain and streamed
messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
chat = llm.create_chat_completion(messages=messages, max_tokens=32, temperature=0)
reply = chat["choices"][0]["message"]
assert reply["role"] == "assistant"
streamed = ""
for chunk in llm.create_chat_completion(messages=messages, max_tokens=32, temperature=0, stream=True):
    delta = chunk["choices"][0]["delta"]
    if "content" in delta:
        streamed += delta["content"]
# (innerq streams the text it returns whole; llama-cpp-python evaluates the cached prompt's last
# token again, alone, and a near tie can then go the other way: the caller compares)

# tokens
tokens = llm.tokenize(b"Hello, world!")
assert llm.detokenize(tokens).decode("utf-8").strip() == "Hello, world!"

print(json.dumps({
    "completion": text,
    "completion_usage": output["usage"],
    "stream": whole,
    "chat": reply["content"],
    "chat_streamed": streamed,
    "chat_usage": chat["usage"],
    "chat_object": chat["object"],
    "n_ctx": llm.n_ctx(),
    "n_vocab": llm.n_vocab(),
    "eos": llm.token_eos(),
}))
