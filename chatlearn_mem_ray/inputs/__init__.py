"""What the loops read: prompts from your files (:mod:`.data`), reward functions (:mod:`.rewards`),
the built-in toy task (:mod:`.tasks`) and the built-in text task (:mod:`.text_task`)."""
