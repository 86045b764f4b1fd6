"""Plain llama-cpp-python (no KVMem) on a 6.5K-token passkey prompt with q8_0 (ggml type 8) and f16 (type 1) K/V:
python plain-llamacpp-q8_0-passkey.py MODEL.gguf 8 1"""

import random
import sys
import time

import llama_cpp


def filler(n: int) -> str:
    words = "alpha beta gamma delta river stone cloud paper window garden signal orbit copper maple lantern".split()
    return " ".join(random.choice(words) for _ in range(n))


random.seed(0)
text = filler(2800) + "\nThe passkey is 42176. Remember it.\n" + filler(3600)
msgs = [{"role": "user", "content": text + "\n\nWhat is the passkey? Answer with the number only."}]
for kind in map(int, sys.argv[2:]):
    llm = llama_cpp.Llama(
        model_path=sys.argv[1], n_ctx=9216, n_threads=2, type_k=kind, type_v=kind, flash_attn=True, verbose=False
    )
    t0 = time.time()
    out = llm.create_chat_completion(messages=msgs, max_tokens=12, temperature=0)
    answer = out["choices"][0]["message"]["content"]
    print("type", kind, "prompt", out["usage"]["prompt_tokens"], repr(answer), round(time.time() - t0, 1), flush=True)
