"""Files a command reads from or writes for the user: staged (atomic) output folders, strict
text input, and the named kill points the robustness suite uses. The lowest package: it
imports nothing else of the project."""
