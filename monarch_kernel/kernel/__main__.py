from .kernel import main

main()
