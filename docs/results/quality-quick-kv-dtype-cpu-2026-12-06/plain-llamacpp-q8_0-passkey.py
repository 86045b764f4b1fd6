import sys, random, time
import llama_cpp
random.seed(0)
words = "alpha beta gamma delta river stone cloud paper window garden signal orbit copper maple lantern".split()
filler = lambda n: " ".join(random.choice(words) for _ in range(n))
text = filler(2800) + "\nThe passkey is 42176. Remember it.\n" + filler(3600)
msgs = [{"role": "user", "content": text + "\n\nWhat is the passkey? Answer with the number only."}]
for tk in sys.argv[1:]:
    t = int(tk)
    llm = llama_cpp.Llama(model_path="/root/.cache/kvmem/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", n_ctx=9216, n_threads=2, type_k=t, type_v=t, flash_attn=True, verbose=False)
    t0 = time.time()
    out = llm.create_chat_completion(messages=msgs, max_tokens=12, temperature=0)
    print("type", t, "prompt", out["usage"]["prompt_tokens"], repr(out["choices"][0]["message"]["content"]), round(time.time()-t0,1), flush=True)
