"""Weight quantization applied to loaded params."""
