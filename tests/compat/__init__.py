"""Engine compatibility: SSE transcripts of vLLM, TGI, SGLang, llama.cpp and Ollama through both drivers."""
