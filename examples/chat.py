"""Chat with the embedded SmolLM2-135M-Instruct through the Python API, streaming the answer.

    python examples/chat.py "What is flash memory?"
"""

import sys

import mlx_flash


def main(question: str, max_tokens: int = 48) -> str:
    model, tokenizer = mlx_flash.load()  # the embedded default model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    answer = ""
    for response in mlx_flash.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        print(response.text, end="", flush=True)
        answer += response.text
    print(f"\n[{response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s, "
          f"peak memory {response.peak_memory:.2f} GB]")
    return answer


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "What is the capital of France?")
