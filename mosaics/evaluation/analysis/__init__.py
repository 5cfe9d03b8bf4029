"""Research probes of trained task models: where the contextual memory looks
(:mod:`.retrieval`: retrieval weights, MQMTAR's recall paths, empty rows) and the
``mosaics eval retrieval | empty-rows | routes`` subcommands that print them
(:mod:`.commands`)."""
