"""Model architectures served with FLASH_MSA."""
