"""Models built already sharded for a mesh: `GPTConfig` (`config`), the GPT-2/Llama/MoE model
(`gpt`) and Hugging Face interop (`hf`)."""
