from npufuse.cli import main

main()
