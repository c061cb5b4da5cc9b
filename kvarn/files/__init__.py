"""Files: atomic writes, the identity a result carries, where workers keep their files."""
