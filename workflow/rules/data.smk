rule wikitext:
    output:
        "resources/data/wiki.test.raw",
    log:
        "logs/wikitext.log",
    benchmark:
        "benchmarks/wikitext.tsv"
    run:
        # config["text"] is where to read it, not what it is (the sha256 fixes that), so it
        # is not a param: moving the file or switching to the hub reruns nothing.
        copy_wikitext(config["text"], output[0], log[0])
