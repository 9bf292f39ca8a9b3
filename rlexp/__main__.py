from rlexp.cli import main

main()
